"""``kda compare`` / ``kda info`` / ``kda bench`` (also ``python -m kda ...``)."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BACKEND_NAMES = ("cuda", "triton", "torch")  # kda.dispatch's order; importing it here would import the backends


class OneLineParser(argparse.ArgumentParser):
    """An argument error is one line on stderr (and exit status 2), not the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def sequence_lengths(text: str) -> list[int]:
    """argparse type: comma-separated lengths >= 0, at least one token in all."""
    try:
        lens = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers such as 1300,547,2048, got {text!r}"
        ) from None
    if any(n < 0 for n in lens):
        raise argparse.ArgumentTypeError(f"lengths must be >= 0, got {text!r}")
    if sum(lens) == 0:
        raise argparse.ArgumentTypeError(f"at least one length must be positive (nothing to compare), got {text!r}")
    return lens


def case_numbers(text: str) -> list[int]:
    """argparse type: comma-separated 0-based case numbers (their range is the bench's: cmd_bench)."""
    try:
        numbers = [int(x) for x in text.split(",")]
    except ValueError:
        numbers = [-1]
    if any(n < 0 for n in numbers):
        raise argparse.ArgumentTypeError(f"expected comma-separated case numbers (0-based) such as 0,2, got {text!r}")
    return numbers


def backend_list(text: str) -> list[str]:
    """argparse type: comma-separated backend names."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in BACKEND_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown backend {', '.join(map(repr, unknown)) or repr(text)}"
                                         f" (choose from {', '.join(BACKEND_NAMES)})")  # fmt: skip
    return names


def _use_interpreter_without_gpu() -> bool:
    """On a machine without a GPU, run the Triton kernels through the interpreter so that
    the comparison still covers them (must happen before kda.triton is imported)."""
    if torch.cuda.is_available() or "TRITON_INTERPRET" in os.environ:
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    return True


def make_problem(args: argparse.Namespace, device: str) -> tuple[tuple, dict]:
    """Random inputs (fixed seed) for chunk_kda: tensors and keyword arguments."""
    gen = torch.Generator(device=device).manual_seed(args.seed)
    dtype = DTYPES[args.dtype]
    if args.seq_lens:
        lens = args.seq_lens
        B, T = 1, sum(lens)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
        N = len(lens)
    else:
        B, T, cu, N = args.batch or 1, args.T, None, args.batch or 1
    H, HV, K, V = args.H, args.HV or args.H, args.D, args.D

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dt)

    tensors = (randn(B, T, H, K), randn(B, T, H, K), randn(B, T, HV, V), randn(B, T, HV, K), randn(B, T, HV))
    kwargs = dict(
        initial_state=randn(N, HV, V, K, dt=torch.float32),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        state_v_first=True,
        cu_seqlens=None if cu is None else cu.to(device),
        cu_seqlens_cpu=cu,
    )
    if args.gate == "precomputed":
        g = -torch.rand(B, T, HV, K, generator=gen, device=device) * 1.5
        tensors = (*tensors[:3], g.to(dtype), tensors[4])
    else:
        kwargs.update(
            use_gate_in_kernel=True,
            A_log=torch.rand(HV, generator=gen, device=device),
            dt_bias=torch.rand(HV * K, generator=gen, device=device),
        )
        if args.gate == "lower_bound":
            kwargs.update(lower_bound=-5.0, safe_gate=True)
    return tensors, kwargs


def time_call(fn, device: str, repeats: int) -> float:
    """Median milliseconds per call (do_bench on a GPU, wall clock on the CPU)."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=max(repeats, 50), return_mode="median")
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def cmd_compare(args: argparse.Namespace) -> int:
    if args.seq_lens and (args.batch is not None or args.T is not None):
        args.error("--seq-lens describes the whole packed batch: leave out --batch and --T")
    interpreted = _use_interpreter_without_gpu()
    import kda
    from kda.reference import relative_rms

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        for name, small in (("T", 64), ("H", 2), ("D", 32)):
            if getattr(args, name) is None:
                setattr(args, name, small)
    else:
        for name, real in (("T", 8192), ("H", 32), ("D", 128)):
            if getattr(args, name) is None:
                setattr(args, name, real)
    if args.HV is not None and args.HV % args.H:
        args.error(f"--HV must be a multiple of --H (GVA: each q/k head serves HV/H value heads), "
                   f"got H={args.H}, HV={args.HV}")  # fmt: skip
    wanted = args.backends or [b.name for b in kda.backends()]
    if args.backends:  # asked for by name: each must run
        reasons = {b.name: b.reason for b in kda.backends() if not b.available}
        for name in wanted:
            if name in reasons:
                print(f"kda compare: error: backend {name!r} is unavailable: {reasons[name]}", file=sys.stderr)
                return 1
    tensors, kwargs = make_problem(args, device)
    shape = f"seq_lens={','.join(map(str, args.seq_lens))}" if args.seq_lens else f"B={args.batch or 1} T={args.T}"
    print(
        f"kda compare: {shape} H={args.H} HV={args.HV or args.H} D={args.D} {args.dtype} gate={args.gate} on {device}"
    )
    if interpreted:
        print("(no GPU: Triton kernels run under TRITON_INTERPRET=1, so their times are not kernel speed)")
        if args.dtype != "fp32":
            print("(the interpreter rounds float32 to 16 bits by truncation where a GPU rounds to nearest: Triton's "
                  f"{args.dtype} errors here read about 8e-3, its GPU errors about 3e-3 on an H200)")  # fmt: skip

    print("reference: chunk-16 form in float64 ...", flush=True)
    ref_kwargs = dict(kwargs)
    for name in ("initial_state", "A_log", "dt_bias"):
        if ref_kwargs.get(name) is not None:
            ref_kwargs[name] = ref_kwargs[name].double()
    o_ref, ht_ref = kda.chunk_kda(*(x.double() for x in tensors), backend="torch", **ref_kwargs)

    available = [b.name for b in kda.backends() if b.available]
    rows, first = [], None
    for name in wanted:
        if name not in available:
            reason = next(b.reason for b in kda.backends() if b.name == name)
            print(f"  {name}: skipped ({reason})")
            continue
        print(f"  running {name} ...", flush=True)

        def call(name=name):
            return kda.chunk_kda(*tensors, backend=name, **kwargs)

        try:
            o, ht = call()
        except kda.BackendUnavailableError as err:
            if args.backends:
                print(f"kda compare: error: {err}", file=sys.stderr)
                return 1
            print(f"  {name}: skipped ({err})")
            continue
        first = first or (name, o)
        ms = time_call(call, device, args.repeats if device == "cpu" or name != "torch" else 3)
        diff = (o.float() - first[1].float()).abs().max().item()
        rows.append((name, relative_rms(o, o_ref), relative_rms(ht, ht_ref), diff, ms))

    if not rows:
        print("kda compare: error: no backend could run this problem", file=sys.stderr)
        return 1
    print()
    ref_name = first[0]
    print(f"| backend | o rel RMS vs fp64 | state rel RMS vs fp64 | max abs diff vs {ref_name} | ms / call |")
    print("|---|---:|---:|---:|---:|")
    for name, eo, es, diff, ms in rows:
        print(f"| {name} | {eo:.2e} | {es:.2e} | {diff:.2e} | {ms:.3f} |")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    import kda

    print(f"kda {kda.__version__}  python {platform.python_version()}  torch {torch.__version__}")
    try:
        import triton

        print(f"triton {triton.__version__}  TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}")
    except ImportError:
        print("triton: not installed")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        print(f"GPU: {props.name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs)")
    else:
        print("GPU: none visible to torch")
    print()
    print("| backend | available | reason |")
    print("|---|---|---|")
    for b in kda.backends():
        print(f"| {b.name} | {'yes' if b.available else 'no'} | {b.reason} |")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from kda import bench

    # Checked before the bench's GPU test and first GPU work (a bad number raised there, after
    # minutes, until a review of 2026-12-07)
    if args.decode:
        if args.cases is not None or args.impls is not None:
            args.error("--decode times its fixed cases and every contender: leave out --cases and --impls")
    elif args.cases is not None:
        if args.long:
            from kda.bench_long import LONG_CASES as table

            what = "long"
        else:
            table, what = (bench.TRAIN_CASES, "training") if args.train else (bench.ANCHOR_CASES, "anchor")
        for n in args.cases:
            if n >= len(table):
                args.error(f"--cases: no case {n} (the {what} cases are 0 to {len(table) - 1})")
    return bench.main(args)


def build_parser() -> argparse.ArgumentParser:
    from kda import __version__  # light: importing kda imports no backend

    parser = OneLineParser(prog="kda", description="Kimi Delta Attention kernels")
    parser.add_argument("--version", action="version", version=f"kda {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    compare = sub.add_parser("compare", help="run every available backend on one problem against fp64")
    compare.add_argument("--T", type=positive_int, default=None,
                         help="tokens per sequence (default 64 on CPU, 8192 on GPU)")  # fmt: skip
    compare.add_argument("--batch", type=positive_int, default=None, help="sequences of T tokens (default 1)")
    compare.add_argument("--seq-lens", type=sequence_lengths, default=None,
                         help="varlen instead of --batch/--T: comma-separated lengths, e.g. 1300,547,2048")  # fmt: skip
    compare.add_argument("--H", type=positive_int, default=None, help="q/k heads (default 2 on CPU, 32 on GPU)")
    compare.add_argument("--HV", type=positive_int, default=None, help="value heads (GVA), a multiple of H; default H")
    compare.add_argument("--D", type=positive_int, default=None,
                         help="head dim K = V (default 32 on CPU, 128 on GPU)")  # fmt: skip
    compare.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="input dtype (default bf16)")
    compare.add_argument("--gate", choices=["lower_bound", "softplus", "precomputed"], default="lower_bound",
                         help="lower_bound: lb * sigmoid in kernel (lb = -5); softplus: in kernel; "
                              "precomputed: g given as log-decays (default lower_bound)")  # fmt: skip
    compare.add_argument("--backends", type=backend_list, default=None,
                         help=f"comma-separated subset of {','.join(BACKEND_NAMES)}, each of which must be "
                              "available (default: every available one)")  # fmt: skip
    compare.add_argument("--repeats", type=positive_int, default=3, help="timed calls per backend (default 3)")
    compare.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    compare.set_defaults(func=cmd_compare, error=compare.error)

    info = sub.add_parser("info", help="backends and environment")
    info.set_defaults(func=cmd_info)

    bench = sub.add_parser("bench", help="time the anchor cases against fla (GPU)")
    bench.add_argument("--out", default="benchmarks/results", help="folder for JSON, Markdown and PNG")
    bench.add_argument("--quick", action="store_true", help="fewer, shorter cases")
    bench.add_argument(
        "--train", action="store_true", help="training: fwd+bwd time and peak memory against fla's (TRAIN_CASES)"
    )
    bench.add_argument(
        "--decode", action="store_true", help="decode steps against fla's fused_recurrent_kda (kda.bench_decode)"
    )
    bench.add_argument(
        "--long", action="store_true", help="long sequences, uncut and segment-split, against fla (kda.bench_long)"
    )
    bench.add_argument(
        "--no-accuracy",
        dest="accuracy",
        action="store_false",
        help="--train without the gradient-accuracy rows (they run at H32: on a cold autotune cache fla tunes that "
        "head count for minutes before the cases start)",
    )
    bench.add_argument("--cases", type=case_numbers, default=None,
                       help="comma-separated case numbers (0-based) to run, default: all")  # fmt: skip
    bench.add_argument(
        "--tag", default="", help="suffix for the result file names (partial runs); --tag=-x for a leading dash"
    )
    bench.add_argument(
        "--impls", default=None, help="comma-separated subset of the contenders (e.g. kda-cuda,fla), default: all"
    )
    bench.set_defaults(func=cmd_bench, error=bench.error)
    return parser


def main(argv: list[str] | None = None) -> int:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as err:
        if args.command != "compare":
            raise
        # kda's own checks of the problem (they name the argument), e.g. --D 300: one line
        print(f"kda compare: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader stopped early (`kda info | head`): not an error of ours. Point stdout at
        # devnull so that Python's flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0

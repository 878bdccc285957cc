"""Integer helpers for the host side of every launch. Triton's own (``triton.cdiv``,
``triton.next_power_of_2``) are constexpr functions since Triton 3.6: 3.4-5 us a call on the
host (CPU machine, 2026-12-01), several per decode step, against 0.1 us for these."""


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ``b > 0``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1

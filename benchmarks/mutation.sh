# Sourced by the mutation scripts (order_mutation.sh; audit_call.sh until 2026-12-07): `keep_original FILE` copies
# FILE aside and puts it back when the script exits, however it exits, so a mutant made in place
# (an editable install imports `kda` from the checkout) never outlives its run; `restore_original`
# puts it back sooner.
keep_original() {
  mutated_file=$1
  mutation_backup=$(mktemp)
  cp "$mutated_file" "$mutation_backup"
  trap 'restore_original; rm -f "$mutation_backup"' EXIT
}
restore_original() {
  cp "$mutation_backup" "$mutated_file"
}

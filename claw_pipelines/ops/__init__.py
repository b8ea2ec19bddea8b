"""Operating a lake: checks, repairs and accounting.

- `integrity`: `claw check` / `claw repair`: inconsistencies found and repaired without
  losing an acknowledged record;
- `ledger`: the waste ledger: per dataset and policy version, what its spec admitted and
  what it left out, and what other datasets re-admitted.
"""

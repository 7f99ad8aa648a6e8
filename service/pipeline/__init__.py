"""One side request from claim to terminal state: stages, usage ledger, events (SPEC §6–8)."""

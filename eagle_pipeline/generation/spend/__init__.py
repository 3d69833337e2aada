"""What a run may spend: a dataset's ledger and caps (`budget`), the data root's ledger shared by parallel runs
(`ledger`)."""

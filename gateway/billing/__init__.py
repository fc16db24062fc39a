"""What a request cost and where it is written down: charges, the usage ledger and
the usage and cost reports."""

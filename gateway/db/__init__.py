"""The billing database: tenants, keys, prices and the usage ledger (SQLAlchemy 2)."""

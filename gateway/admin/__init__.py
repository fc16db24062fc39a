"""`cachepoint-admin`: tenants, keys, policies, prices and usage from the command line."""

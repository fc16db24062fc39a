"""The cache_control contract as pure functions: render, resolve breakpoints."""

"""Optional integrations with other packages (each imported only where that package is installed)."""

"""dsgd's built-in plugins, written against dsgd_cli.api only and registered by entry point."""

"""Built-in tasks: data made or loaded locally, never downloaded."""

"""dsgd: a command-line workbench for distributed data-parallel SGD on PyTorch."""

__version__ = "0.1.0"

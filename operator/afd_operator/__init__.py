"""kopf operator reconciling AFDDeployment resources (never imports torch)."""

__version__ = "0.1.0"

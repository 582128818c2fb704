"""Connectors between attention and FFN ranks: control plane, data plane, transports."""

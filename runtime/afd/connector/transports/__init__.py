"""One module per transport, each exporting `TRANSPORT` (`afd.connector.registry`)."""

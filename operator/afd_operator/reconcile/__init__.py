"""Reconcile one AFDDeployment: the pass (deployment: parse → observe → plan → apply → status), the status it
writes (status) and the group Secret it keeps (secret). Side effects go through `apiserver.Store` only."""

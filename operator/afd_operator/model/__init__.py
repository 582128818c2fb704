"""The AFDDeployment as the operator reads it: the typed spec, checked as the CRD checks it, and the names
and labels its children are given. Pure; the bottom layer of the operator."""

"""Pure renderers: an AFDDeployment's spec in, Kubernetes manifests out (the children of each group and of the
resource, the role pod templates, pod hardening and the group Secret, network policies)."""

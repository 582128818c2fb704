"""spec.autoscaling: the number of groups from the service levels they meet (docs/autoscaling.md): the
attention ranks' series as signals (signals), the pure decision (group_count), a group's drain inside a
reconcile (step), and where the samples come from (feed)."""

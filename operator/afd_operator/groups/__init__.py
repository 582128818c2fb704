"""Groups, the unit the operator creates, replaces, restarts and deletes: what it sees of them (observe) and
the next actions for them (plan). Pure."""

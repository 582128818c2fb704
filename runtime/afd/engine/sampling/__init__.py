"""Choosing each step's tokens on the device: the sampler, the logits controls it applies first (penalties, bias,
allowed and banned tokens and words), and log-probabilities of the prompt."""

"""The attention rank's serving engine: requests, scheduler, sampler, detokenizer, step loop."""

"""Engine: request state, paged KV blocks, scheduler, runner, sampler, engine loops."""

"""Engine: the worker engine on CPU: TTFT, decode, scheduler, radix cache, host tier, HTTP."""

"""dsv4's engine core: config, model registry, runner, scheduler, sequences, the state pool,
sampling, tokenizer, weights, metrics, and PD controllers over a transport seam. No HTTP server,
no Kubernetes: `dsv4_serve` puts this behind the OpenAI API."""

"""One module per CLI command; each exposes `register(app)`. Modules here must import torch and
diffusers only inside the command bodies, so that `cpdoctor --help` stays fast."""

"""omnikv: KV cache transfer between the stages of multi-stage inference pipelines."""

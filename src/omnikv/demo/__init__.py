"""The two-stage demo behind ``omnikv demo`` (``make demo``): a tiny paged model, a pipeline."""

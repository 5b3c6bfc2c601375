"""Training extensions that SB3 lacks, each a narrow subclass or a wrapper at one of SB3's seams: mixed precision,
gradient accumulation, prioritized replay, torch.compile, and the one wrapper around an optimizer's step."""

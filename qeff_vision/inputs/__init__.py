"""What a user hands the runtime: prompts rendered and processed, request files, sampling parameters."""

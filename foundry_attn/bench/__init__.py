"""Side-by-side benchmarks behind ``foundry-attn bench``: scripts that print numbers, not timed tests."""

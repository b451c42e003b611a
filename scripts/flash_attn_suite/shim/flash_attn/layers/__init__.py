"""flash_attn.layers for the test shim: only the rotary helper the tests use."""

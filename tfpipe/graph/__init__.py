"""Graph optimizations that change no result: lean call ops, Grappler-slimmed bodies, CPU gradients."""

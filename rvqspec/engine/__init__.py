"""The engine: the predictor, sampling, trees, drafters, the batched AR and speculative rounds, and the policy that picks one per batch size. It imports only itself."""

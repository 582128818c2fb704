"""CUDA graphs: bucket policy (pure), capture into one pool, attention decode graphs, FFN graph cache."""

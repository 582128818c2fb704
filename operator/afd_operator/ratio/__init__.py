"""spec.ratio: the attention:FFN ratio chosen from the groups' metrics (docs/ratio.md): the pure
recommendation (recommend) and where its samples come from (feed)."""

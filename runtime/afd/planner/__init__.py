"""Choose the attention:FFN ratio from what a deployment measures (`afd plan`).

`samples` turns Prometheus expositions of the ranks into per-step costs over time windows;
`cost` fits a cost model to them and predicts the step time and tokens/s of any xAyF;
`advice` compares topologies and explains the choice; `levels` checks a fit against chosen
steady windows (the benchmarks' acceptance); `collect` scrapes the ranks. All but `collect` are pure.
"""

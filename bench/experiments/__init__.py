"""One-off A/Bs (a change off and on, interleaved), kept with the results they produced."""

"""The rules of mixture-of-experts layers: grouped and batched expert matmuls, the routed region's
ops, the expert-row placement of their results, and the token histogram."""

"""Fleet simulation in virtual time: real policy and prefix-tree code, real RadixCache."""

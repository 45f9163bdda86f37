"""fixes: the tools that change a running job. `guard` (cheap protection for long runs), `refreeze` (rebuild DDP
for a new frozen set), `sync` (`sync_gradients`, a correct manual all-reduce). Their public names are in
`ddp_doctor` (`from ddp_doctor import guard` is the function)."""

"""observation: what one rank sees, with local hooks and probes only (nothing here communicates).

The hooks on DDP's forward and on every gradient (`forward`, `backward`), the step in progress (`timeline`), the
closed steps that become the rank's `RankRecord` (`steplog`), the autograd walk (`autograd`), the observed model
(`target`), how an early end is recorded (`crash`), what DDP was built with (`wrapstate`), fingerprints
(`fingerprint`), hook plumbing (`hooks`), and the process-wide probes one observer listens to (`probes`):
reentrant checkpoints (`reentrant`), DataLoaders (`dataloaders`), GradScaler (`gradscaler`), the script's
collectives (`collectives`), gradient clipping and where gradient sync was turned off (`gradedits`).
"""

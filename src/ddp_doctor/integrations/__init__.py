"""ddp-doctor inside the training frameworks users already have.

Each integration is imported by its full name, so that `import ddp_doctor` never imports a framework:

- `ddp_doctor.integrations.transformers`: `DoctorCallback` for the HF `Trainer`; fixes as `TrainingArguments` fields.
- `ddp_doctor.integrations.accelerate`: `observe` for `accelerator.prepare(...)` models, and `kwargs_handler(report)`.
- `ddp_doctor.integrations.lightning`: `DoctorCallback` for `lightning.Trainer` (and `pytorch_lightning.Trainer`)
  with a DDP strategy; fixes as `DDPStrategy(...)` or strategy strings.

Install the one you need as an extra: `pip install "ddp-doctor[transformers]"`, `[accelerate]`, `[lightning]`.
"""

from __future__ import annotations

__all__: list[str] = []

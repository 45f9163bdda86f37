import sys

from ddp_doctor.cli import main

sys.exit(main())

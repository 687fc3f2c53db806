"""Which optional GPU components the image holds, checked at build time: the build fails without
DALI (the input pipeline's GPU backend), and says plainly whether apex's transducer joint + loss
(loss.backend: apex) and its DistributedFusedLAMB are there (NGC images have carried one, both
or neither; this project does not need them)."""

import importlib
import sys

CHECKS = [
    ("DALI (data.backend: dali)", "nvidia.dali", True),
    ("apex transducer joint + loss (loss.backend: apex)", "apex.contrib.transducer", False),
    (
        "apex DistributedFusedLAMB",
        "apex.contrib.optimizers.distributed_fused_lamb",
        False,
    ),
    ("Triton (the fused loss and LAMB kernels)", "triton", True),
]


def main() -> int:
    missing_required = []
    for what, module, required in CHECKS:
        try:
            importlib.import_module(module)
            print(f"present: {what}")
        except Exception as err:  # an extension that fails to load is as absent as a missing one
            print(f"ABSENT:  {what} ({type(err).__name__}: {str(err).splitlines()[0]})")
            if required:
                missing_required.append(what)
    if missing_required:
        print(f"the image lacks what training needs: {', '.join(missing_required)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

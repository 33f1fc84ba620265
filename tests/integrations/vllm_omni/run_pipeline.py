"""Runs vllm-omni's own ``Omni`` pipeline (AR -> diffusion) once and prints a JSON line.

Usage: ``python run_pipeline.py MODEL_DIR WORK_DIR MANAGER`` in the vllm-omni test environment
(``make test-vllm`` builds it), MANAGER ``omnikv`` or ``reference``. The prompt's token ids are
read from ``WORK_DIR/prompt.json``; the diffusion stage's pipeline
(``omnikv_omni_fixture.pipeline``) writes the KV it received to ``WORK_DIR/report``. Called by
``test_vllm_omni_pipeline.py``, which compares that KV with transformers'.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

DEPLOY = """\
pipeline: {pipeline}
dtype: float32
async_chunk: false
stages:
  - stage_id: 0
    max_num_seqs: 1
    max_num_batched_tokens: 256
    max_model_len: 256
    enforce_eager: true
    enable_prefix_caching: false
    num_gpu_blocks_override: 16
    output_connectors:
      to_stage_1: shm
    default_sampling_params:
      temperature: 0.0
      max_tokens: 1
  - stage_id: 1
    max_num_seqs: 1
    enforce_eager: true
    enable_prefix_caching: false
    input_connectors:
      from_stage_0: shm
connectors:
  shm:
    name: SharedMemoryConnector
"""


def main() -> int:
    model, work, manager = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    report = work / "report"
    report.mkdir(parents=True, exist_ok=True)
    os.environ["OMNIKV_OMNI_CPU_PLATFORM"] = "1"
    os.environ["OMNIKV_OMNI_REPORT_DIR"] = str(report)
    os.environ["OMNIKV_OMNI_MANAGER"] = manager
    import omnikv_omni_fixture
    from vllm import SamplingParams
    from vllm_omni import Omni
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    omnikv_omni_fixture.register()
    deploy = work / "deploy.yaml"
    deploy.write_text(DEPLOY.format(pipeline=omnikv_omni_fixture.PIPELINE_KEY))
    tokens = json.loads((work / "prompt.json").read_text())
    omni = Omni(model=str(model), deploy_config=str(deploy))
    try:
        outputs = omni.generate(
            [{"prompt_token_ids": tokens}],
            [SamplingParams(temperature=0.0, max_tokens=1), OmniDiffusionSamplingParams()],
            use_tqdm=False,
        )
    finally:
        omni.close()
    reports = sorted(p.name for p in report.iterdir())
    print(json.dumps({"outputs": len(outputs), "reports": reports}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

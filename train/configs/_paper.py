"""The paper's training stages (docs/ALGORITHM.md 4), shared by the per-target config files.

Stage 1: short general text with anchor-offset positions; stage 2: long documents; stage 3: long SFT
data (LongCoT, used for QwQ). Batch sizes count sequences per optimiser step. The long stages'
sequences are too long for an offset (seq_len is near MAX_LEN), so anchor-offset is off there.
"""

from train.config import Stage


def paper_stages(*, max_offset: int, long_seq_len: int, data_root: str, sft: bool) -> tuple[Stage, ...]:
    stages = [
        Stage(
            data=(f"{data_root}/slimpajama-6b",),
            seq_len=1024,
            batch_size=2048,
            lr=5e-4,
            micro_batch_size=16,
            anchor_offset=True,
            max_offset=max_offset,
        ),
        Stage(
            data=(f"{data_root}/prolong-64k",),
            seq_len=long_seq_len,
            batch_size=256,
            lr=5e-6,
            micro_batch_size=1,
            anchor_offset=False,
            max_offset=max_offset,
        ),
    ]
    if sft:
        stages.append(
            Stage(
                data=(f"{data_root}/longcot",),
                seq_len=long_seq_len,
                batch_size=256,
                lr=5e-6,
                micro_batch_size=1,
                anchor_offset=False,
                max_offset=max_offset,
            )
        )
    return tuple(stages)

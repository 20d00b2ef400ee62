"""The README's first screen: a Lightning Trainer whose weights reach a vLLM engine after every optimizer step."""
import os

import torch
from lightning.pytorch import LightningModule, Trainer

from lightning_fsdp_export import ColocatedVLLM, LazyExportFSDP2, VLLMWeightSync
from lightning_fsdp_export.testing import tiny_qwen2  # a tiny random Qwen2; use your own model and checkpoint


class Policy(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_qwen2()  # any transformers causal LM

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss  # your RL loss, from the engine's rollouts

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


if __name__ == "__main__":
    if os.environ.get("LOCAL_RANK", "0") == "0":
        tiny_qwen2().to(torch.bfloat16).save_pretrained("runs/quickstart")  # the checkpoint vLLM starts from
    engine = ColocatedVLLM(model="runs/quickstart", dtype="bfloat16", max_model_len=128, enforce_eager=True)
    sync = VLLMWeightSync(engine, every_n_train_steps=1, verify="logprobs")  # push, then check, every step
    trainer = Trainer(max_steps=3, strategy=LazyExportFSDP2(pretrained="runs/quickstart"), callbacks=[sync],
                      logger=False, enable_checkpointing=False)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randint(0, 512, (8, 16))), batch_size=2)
    trainer.fit(Policy(), data)
    out = engine.llm.generate([{"prompt_token_ids": list(range(1, 9))}], use_tqdm=False)[0].outputs[0]
    print(f"engine on version {sync.version}, logprob gap {sync.last_verify_diff:.3f}, tokens {out.token_ids[:4]}")

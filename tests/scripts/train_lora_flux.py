"""A small Flux LoRA trainer, written the way diffusers' example trainers are written.

Like ``examples/dreambooth/train_dreambooth_lora_flux.py``: arguments from argparse, an
``Accelerator``, the transformer and scheduler loaded with ``from_pretrained`` from a pipeline
directory, a PEFT LoRA added with ``add_adapter``, flow-matching loss on packed latents, the LoRA
saved with ``FluxPipeline.save_lora_weights``. Latents and text embeddings are random (seeded)
instead of encoded images and prompts, as with the example's cached latents. It knows nothing
about gradseam: tests/test_launch.py runs it plainly and under ``gradseam run`` and compares.

Writes ``pytorch_lora_weights.safetensors`` and ``losses.json`` (the loss of every step) to
``--output_dir``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from diffusers.training_utils import compute_density_for_timestep_sampling
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from torch.utils.data import DataLoader, TensorDataset


def parse_args(input_args: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Tiny Flux LoRA training.")
    parser.add_argument("--pretrained_model_name_or_path", type=str, required=True)
    parser.add_argument("--output_dir", type=str, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max_train_steps", type=int, default=3)
    parser.add_argument("--train_batch_size", type=int, default=1)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--latent_size", type=int, default=8, help="latent height and width (even)")
    parser.add_argument("--gradient_checkpointing", action="store_true")
    return parser.parse_args(input_args)


def main(args: argparse.Namespace) -> None:
    accelerator = Accelerator(project_config=ProjectConfiguration(project_dir=args.output_dir))
    set_seed(args.seed)

    noise_scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(
        args.pretrained_model_name_or_path, subfolder="scheduler"
    )
    noise_scheduler_copy = copy.deepcopy(noise_scheduler)
    transformer = FluxTransformer2DModel.from_pretrained(args.pretrained_model_name_or_path, subfolder="transformer")
    transformer.requires_grad_(False)
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()

    transformer.add_adapter(LoraConfig(
        r=args.rank, lora_alpha=args.rank, init_lora_weights="gaussian",
        target_modules=["attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2",
                        "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp"],
    ))
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate)

    # the "dataset": cached latents and text embeddings, one per step
    config = transformer.config
    channels = config.in_channels // 4  # packing turns 2x2 patches of C channels into 4C
    g = torch.Generator().manual_seed(args.seed)
    n = args.max_train_steps * args.train_batch_size
    dataset = TensorDataset(
        torch.randn(n, channels, args.latent_size, args.latent_size, generator=g),
        torch.randn(n, 8, config.joint_attention_dim, generator=g),
        torch.randn(n, config.pooled_projection_dim, generator=g),
    )
    dataloader = DataLoader(dataset, batch_size=args.train_batch_size, shuffle=False)
    transformer, optimizer, dataloader = accelerator.prepare(transformer, optimizer, dataloader)

    def get_sigmas(timesteps: torch.Tensor, n_dim: int = 4) -> torch.Tensor:
        sigmas = noise_scheduler_copy.sigmas.to(accelerator.device)
        schedule = noise_scheduler_copy.timesteps.to(accelerator.device)
        sigma = sigmas[[(schedule == t).nonzero().item() for t in timesteps]].flatten()
        while sigma.ndim < n_dim:
            sigma = sigma.unsqueeze(-1)
        return sigma

    losses = []
    transformer.train()
    for model_input, prompt_embeds, pooled_prompt_embeds in dataloader:
        with accelerator.accumulate(transformer):
            bsz, c, h, w = model_input.shape
            text_ids = torch.zeros(prompt_embeds.shape[1], 3)
            latent_image_ids = FluxPipeline._prepare_latent_image_ids(bsz, h // 2, w // 2, accelerator.device,
                                                                      model_input.dtype)
            noise = torch.randn_like(model_input)
            u = compute_density_for_timestep_sampling(weighting_scheme="none", batch_size=bsz)
            indices = (u * noise_scheduler_copy.config.num_train_timesteps).long()
            timesteps = noise_scheduler_copy.timesteps[indices]
            sigmas = get_sigmas(timesteps, n_dim=model_input.ndim)
            noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
            packed = FluxPipeline._pack_latents(noisy_model_input, bsz, c, h, w)
            model_pred = transformer(
                hidden_states=packed,
                timestep=timesteps / 1000,
                guidance=None,
                pooled_projections=pooled_prompt_embeds,
                encoder_hidden_states=prompt_embeds,
                txt_ids=text_ids,
                img_ids=latent_image_ids,
                return_dict=False,
            )[0]
            target = FluxPipeline._pack_latents(noise - model_input, bsz, c, h, w)
            loss = torch.mean((model_pred.float() - target.float()) ** 2)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        lora = get_peft_model_state_dict(accelerator.unwrap_model(transformer))
        FluxPipeline.save_lora_weights(args.output_dir, transformer_lora_layers=lora)
        with open(os.path.join(args.output_dir, "losses.json"), "w") as f:
            json.dump(losses, f)
    accelerator.end_training()


if __name__ == "__main__":
    main(parse_args())

"""transformers' `generate` timed the way the generation baselines report it: one greedy generation of exactly
`new_tokens` per row, split into prefill (until the first token's logits) and decode (the rest) by a logits
processor that notes when each token's logits are ready. Imports torch only when called."""

import time


class StepTimer:
  """A logits processor: called once per generated token, after the forward pass that produced its logits; records
  when."""

  def __init__(self, synchronize):
    self.synchronize, self.times = synchronize, []

  def __call__(self, input_ids, scores):
    self.synchronize()
    self.times.append(time.perf_counter())
    return scores


def timed_generate(model, device: str, vocab: int, batch: int, prompt_len: int, new_tokens: int,
                   no_grad: bool = False, **generate_args) -> dict:
  """Random prompts (seed 0) of prompt_len tokens; the figures generate_throughput reports, under its keys. Runs
  under torch.inference_mode, or no_grad (ZeRO-3 swaps parameter data in place, which inference mode forbids)."""
  import torch
  import transformers

  synchronize = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
  input_ids = torch.randint(0, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(0)).to(device)
  timer = StepTimer(synchronize)
  synchronize()
  start = time.perf_counter()
  with torch.no_grad() if no_grad else torch.inference_mode():
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
                         logits_processor=transformers.LogitsProcessorList([timer]), **generate_args)
  synchronize()
  end = time.perf_counter()
  prefill, decode = timer.times[0] - start, timer.times[-1] - timer.times[0]
  return {
      "batch": batch, "generated_shape": list(out.shape), "prefill_seconds": prefill, "decode_seconds": decode,
      "total_seconds": end - start, "prefill_tokens_per_s": batch * prompt_len / prefill,
      "decode_tokens_per_s": batch * (new_tokens - 1) / decode if new_tokens > 1 else None,
      "generation_tokens_per_s": batch * new_tokens / (end - start),
      "first_tokens": out[:2, prompt_len:].tolist()}

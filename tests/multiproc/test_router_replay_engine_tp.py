"""The engine's routing record (`EngineConfig.return_routed_experts`, routing replay R3) at TP 2 over two gloo ranks
(float64, CPU): every rank records the same experts (the router is whole on each, its input all-reduced alike), and
they are the training model's own routing of prompt + response (chunked prefill, 3 samples a shared prompt)."""

import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed


def _body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    from models import Transformer
    from rollout import EngineConfig, LLMEngine, SamplingParams
    from tests.unit.test_router_replay import moe_args, own_routing

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = Transformer.build(moe_args(), seed=0).double()
    config = EngineConfig(dtype=torch.float64, block_size=4, num_kv_blocks=64, max_num_batched_tokens=8,
                          return_routed_experts=True)
    engine = LLMEngine(model.args, config, tp_mesh=mesh["tp"], device="cpu")
    engine.load_weights(model.named_parameters())
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (3, 17, 9)]
    outs = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=4, ignore_eos=True))
    for out in outs:
        tokens = out.prompt_token_ids + out.token_ids
        want = own_routing(model, torch.tensor([tokens]))[0, :-1]
        assert torch.equal(out.routed_experts.long(), want), (rank, out.prompt_index, out.sample_index)
    gathered = [None, None]
    dist.all_gather_object(gathered, [o.routed_experts for o in outs])
    assert all(torch.equal(a, b) for a, b in zip(*gathered))


def test_tp2_ranks_record_the_training_models_routing():
    run_distributed(_body, 2)

"""The hardware catalogue as data: GPUs and links, each number with its source.

Sources (short names used in the comments below):
  [nv-h100]  https://www.nvidia.com/en-us/data-center/h100/ ; per-dtype dense rates as tabulated from NVIDIA's
             datasheet at https://glennklockwood.com/garden/processors/h100 (H100 SXM5: 132 SMs, 3.35 TB/s,
             900 GB/s NVLink, BF16 989.4 TFLOP/s dense, FP8 1978.9, TF32 494.7, FP32 66.9)
  [nv-h200]  https://www.nvidia.com/en-us/data-center/h200/ ; https://aiwiki.ai/wiki/nvidia_h200 (141 GB HBM3e,
             4.8 TB/s, same GH100 compute as H100, NVLink 4 900 GB/s)
  [nv-b200]  https://www.nvidia.com/en-us/data-center/dgx-b200/ ; https://glennklockwood.com/garden/processors/B200
             (HGX B200 at 1,000 W: BF16 2,250 TFLOP/s dense, FP8 4,500, TF32 1,100; 8 TB/s; NVLink 5 1.8 TB/s)
  [nv-a100]  https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
             via https://glennklockwood.com/garden/processors/A100 (108 SMs, BF16 312, TF32 156, FP32 19.5,
             80 GB HBM2e 2,039 GB/s, NVLink 300+300 GB/s)
  [h800]     https://aiwiki.ai/wiki/nvidia_h800 ; https://www.philisun.com/technical-analysis/nvidia-h800-vs-h100-a-technical-deep-dive-into-politically-defined-ai-chips
             (same GH100 die and BF16/FP8 rates as H100; NVLink cut to 400 GB/s total bidirectional)
  [a800]     https://techpowerup.com/news-tags/chip?page=8 (A800: A100 with chip-to-chip 600 -> 400 GB/s)
  [here]     /work/.library/device/KINDS.md: an 8192^3 bf16 GEMM through PyTorch on one H200 ran at 769-798
             TFLOP/s on random data (0.78-0.81 of 989.4); a device copy moved ~4.3 TB/s of 4.8 (0.9)
  [nccl]     NVIDIA/nccl src/graph/tuning.cc at v2.27.5-1 (commit 3ea7eedf; unchanged through 2.30.7): NCCL's
             own cost model. Ring base latency (LL, LL128, Simple) = (6.6, 14.0, 8.4) us; per-step hwLat ring
             NVLink = (0.6, 1.9, 3.4) us, PCI = (1.0, 2.5, 5.7) us, NET = (2.7, 4.0, 14.0) us; NVLS hwLat on
             NVLink 25 us; llMaxBws (one node) Ampere 87.7, Hopper 141, Blackwell 282 GB/s (Ada counts as
             Ampere); Ampere (sm80) ring busbw capped at 235 GB/s (commit 01afd20a)
  [nccl-topo] NVIDIA/nccl src/graph/topo.h at v2.27.5-1: PCI_BW 12 GB/s for a PCIe Gen3 x16 link (NCCL doubles it
             per generation: 24 for Gen4), SKL_QPI_BW 10 GB/s between two Intel Skylake-class sockets
  [azure-nccl] https://github.com/Azure/AI-benchmarking-guide: Azure_Results/ND_H200_v5_results.md (8 x H200,
             NCCL 2.20.5) and "Azure Results/ND_H100_v5_results.md" (8 x H100, NCCL 2.18.5):
             nccl-tests AllReduce busbw with NCCL_ALGO=NVLS by size. H200: 240.41 GB/s at 16 MiB (122 us: 25 us +
             16 MiB at 0.67 x 450 GB/s), 467.58 at 1 GiB; H100: 234.45 at 16 MiB (0.65)
  [torch-call] what one torch.distributed collective call costs beyond NCCL's model of its kernel [derived]: the
             smallest torch-level all-reduce on 8 x H100, 19.19 us at 128 B (ByteDance-Seed/Triton-distributed#57,
             https://github.com/ByteDance-Seed/Triton-distributed/issues/57), minus NCCL's model of it (LL ring:
             6.6 + 14 x 0.6 = 15.0 us [nccl]) = 4.2 us. The rows of that table from 64 KiB up are validation rows
             (validation/published.csv), not inputs
  [nv-l20]   NVIDIA L20 (AD102, PCIe 4.0 x16, 64 GB/s bidirectional; 48 GB GDDR6, 864 GB/s; 92 SMs at 2.52 GHz boost):
             https://www.topcpu.net/en/gpu-c/a40-pcie-vs-l20 ; its dense FP16/BF16 tensor rate [derived]: 92 SMs x
             2.52 GHz x 512 FLOP per SM per clock (Ada's rate, as L40's 181 TFLOP/s = 142 x 2.49 GHz x 512) = 118.7
  [nv-l40s]  https://www.nvidia.com/en-us/data-center/l40s/ (L40S: BF16/FP16 362.05 TFLOP/s dense, FP8 733, TF32
             183, FP32 91.6; 48 GB GDDR6 864 GB/s; PCIe Gen4 x16 64 GB/s bidirectional); 142 SMs [est: public reports]
  [vllm-ca]  vllm-project/vllm#24111 (https://github.com/vllm-project/vllm/pull/24111), 2 x H100: vLLM's one-stage
             custom all-reduce of 0.50 MB in 0.007 ms, one GPU-initiated NVLink exchange (a flag round, the peer's
             block read and added) with its kernel launch
  [gin]      arXiv 2511.15076 (GPU-Initiated Networking for NCCL, the device API of NCCL 2.28): a 16.7 us round trip
             for small messages over InfiniBand (GPUDirect Async, H100 nodes), one way 8.4 us [derived]
  [est]      an ESTIMATE, no published figure found; on GPUs the start-up probe (megatron/probe.py) replaces the GEMM
             rates and the hop costs with measured ones.

Not per device (hardware.py defaults, [est]): a GEMM or add kernel costs at least kernel_us = 3 us; HBM reaches 0.9
of its datasheet rate ([here]: 4.3 of 4.8 TB/s); a GEMM slice beside one of our transfers runs 10 % slower
(Cluster.slowdown, --overlap-slowdown). That last one is the least known input: NVIDIA/nccl#1428 reports a GEMM
going from 1.18 to 2.08 ms beside an NCCL all-gather on A100 (an NCCL developer: memory-bandwidth contention) and
NVIDIA/nccl#1433 both kernels slowing beside P2P send/recv, while a copy-engine transfer takes no SMs at all.

Our executor's hop (`p2p_us`): one NCCL send/recv kernel per ring step, priced as NCCL's one-step ring in its
Simple protocol ([nccl]: base 8.4 + one hop) plus the torch call's own cost ([torch-call] 4.2 us, as every stock
collective pays): 16.0 us on NVLink, 18.3 us over PCIe and 26.6 us across nodes [est: derived, not measured; the
start-up probe measures it on GPUs]. A single point-to-point flow is taken to reach the same fraction of the link as NCCL's ring
(p2p_efficiency = coll_efficiency) [est]: on an NVSwitch node one GPU's sends share its one NVLink egress, so a
bidirectional ring moves no more bytes per second than a unidirectional one.
"""
from __future__ import annotations

from .hardware import Gpu, Link

_NVL_BASE = (6.6, 14.0, 8.4)  # [nccl] ring base latency (LL, LL128, Simple), us
_NVL_HOP = (0.6, 1.9, 3.4)  # [nccl] hwLat NVLink ring, us per step
_PCI_HOP = (1.0, 2.5, 5.7)  # [nccl] hwLat PCI ring, us per step
_NET_HOP = (2.7, 4.0, 14.0)  # [nccl] hwLat NET ring, us per step
_CALL = 4.2  # [torch-call]
_P2P_NVL = 8.4 + 3.4 + _CALL  # [nccl]-derived [est]: one Simple ring step on NVLink, as a torch call
_P2P_PCI = 8.4 + 5.7 + _CALL  # [nccl]-derived [est]: one Simple ring step over PCIe, as a torch call
_P2P_NET = 8.4 + 14.0 + _CALL  # [nccl]-derived [est]: one Simple ring step across nodes, as a torch call
_NVLS = {"nvls_efficiency": 476.0 / 450.0, "nvls_mid_efficiency": 0.67}  # [nccl-290] large, [azure-nccl] mid-size

_HOPPER = {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "tf32": 494.7, "fp32": 66.9}  # [nv-h100]

GPUS = {
    # H100 SXM5 80 GB: rates, SMs, HBM [nv-h100]; GEMM efficiency 0.79 measured on the same silicon (H200) [here]
    "h100": Gpu("h100", _HOPPER, hbm_gbps=3350.0, sms=132, gemm_efficiency=0.79),
    # H200 SXM: H100 compute, 4.8 TB/s [nv-h200]; 0.79 [here]
    "h200": Gpu("h200", _HOPPER, hbm_gbps=4800.0, sms=132, gemm_efficiency=0.79),
    # H800 SXM: H100 compute and memory, NVLink cut [h800]; 0.79 [here, same silicon]
    "h800": Gpu("h800", _HOPPER, hbm_gbps=3350.0, sms=132, gemm_efficiency=0.79),
    # HGX B200 at 1,000 W [nv-b200]; 148 SMs [est: public reports, not in the datasheet]; efficiency 0.75 [est]
    "b200": Gpu("b200", {"bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0, "tf32": 1100.0, "fp32": 80.0},
                hbm_gbps=8000.0, sms=148, gemm_efficiency=0.75),
    # A100 SXM4 80 GB [nv-a100]; GEMM efficiency 0.85 [est]
    "a100": Gpu("a100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
                hbm_gbps=2039.0, sms=108, gemm_efficiency=0.85),
    # A800 SXM4 80 GB: A100 compute and memory [a800]
    "a800": Gpu("a800", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
                hbm_gbps=2039.0, sms=108, gemm_efficiency=0.85),
    # L20 (PCIe): rates [nv-l20] (FP8 twice FP16, as on every Ada part [est]); GEMM efficiency 0.79 [est, as Hopper]
    "l20": Gpu("l20", {"bf16": 118.7, "fp16": 118.7, "fp8": 237.4, "tf32": 59.4, "fp32": 59.4},
               hbm_gbps=864.0, sms=92, gemm_efficiency=0.79),
    # L40S (PCIe): rates and memory [nv-l40s]; GEMM efficiency 0.79 [est, as Hopper]
    "l40s": Gpu("l40s", {"bf16": 362.05, "fp16": 362.05, "fp8": 733.0, "tf32": 183.0, "fp32": 91.6},
                hbm_gbps=864.0, sms=142, gemm_efficiency=0.79),
}

LINKS = {
    # NVLink 3 (A100): 300 GB/s per direction [nv-a100]; NCCL caps sm80 ring busbw at 235 GB/s [nccl] -> 0.78
    "nvlink3": Link("nvlink3", 300.0, 235.0 / 300.0, 235.0 / 300.0, _NVL_BASE, _NVL_HOP, _P2P_NVL, call_us=_CALL,
                    ll_max_gbps=87.7),
    # A800 NVLink: 400 GB/s bidirectional -> 200 per direction [a800]; efficiency as A100 [est]
    "nvlink3_a800": Link("nvlink3_a800", 200.0, 0.78, 0.78, _NVL_BASE, _NVL_HOP, _P2P_NVL, call_us=_CALL,
                         ll_max_gbps=87.7),
    # NVLink 4 (H100/H200): 900 GB/s bidirectional -> 450 per direction [nv-h100]; ring busbw 0.80 of it [est];
    # NVLink SHARP all-reduce ~476 GB/s busbw on large messages [nccl-290] -> 476/450, 0.67 mid-size [azure-nccl]
    "nvlink4": Link("nvlink4", 450.0, 0.80, 0.80, _NVL_BASE, _NVL_HOP, _P2P_NVL, **_NVLS, call_us=_CALL,
                    ll_max_gbps=141.0),
    # H800 NVLink: 400 GB/s bidirectional -> 200 per direction [h800]; 0.80 [est]; NVLS as H100 [est]
    "nvlink4_h800": Link("nvlink4_h800", 200.0, 0.80, 0.80, _NVL_BASE, _NVL_HOP, _P2P_NVL, **_NVLS, call_us=_CALL,
                         ll_max_gbps=141.0),
    # NVLink 5 (B200): 1.8 TB/s bidirectional -> 900 per direction [nv-b200]; efficiencies as NVLink 4 [est]
    "nvlink5": Link("nvlink5", 900.0, 0.80, 0.80, _NVL_BASE, _NVL_HOP, _P2P_NVL, **_NVLS, call_us=_CALL,
                    ll_max_gbps=282.0),
    # PCIe Gen4 x16, 8 GPUs on two Intel sockets (the usual 8-GPU PCIe server): 32 GB/s per direction [nv-l20]; a
    # ring crosses the socket link, which NCCL rates at 10 GB/s for Skylake-class CPUs [nccl-topo] -> 10/32; no
    # NVLS; NCCL's PCI latencies [nccl]; LL cap as Ampere (Ada) [nccl]
    "pcie4_2s": Link("pcie4_2s", 32.0, 10.0 / 32.0, 10.0 / 32.0, _NVL_BASE, _PCI_HOP, _P2P_PCI, call_us=_CALL,
                     ll_max_gbps=87.7),
    # InfiniBand NDR 400 Gb/s = 50 GB/s per NIC [cx7/cx8]; 46-48 GB/s reached per NIC [nccl-290] -> 0.94
    "ib_ndr": Link("ib_ndr", 50.0, 0.94, 0.94, _NVL_BASE, _NET_HOP, _P2P_NET, call_us=_CALL),
    # InfiniBand XDR 800 Gb/s = 100 GB/s per NIC [cx7/cx8]; 0.94 as NDR [est]
    "ib_xdr": Link("ib_xdr", 100.0, 0.94, 0.94, _NVL_BASE, _NET_HOP, _P2P_NET, call_us=_CALL),
    # RoCE 400 GbE = 50 GB/s per NIC [cx7/cx8]; 0.90 [est]
    "roce_400": Link("roce_400", 50.0, 0.90, 0.90, _NVL_BASE, _NET_HOP, _P2P_NET, call_us=_CALL),
    # HPE Slingshot 11: 200 Gb/s = 25 GB/s per NIC [slingshot]; 0.90 [est]; NCCL NET latencies [nccl]
    "slingshot11": Link("slingshot11", 25.0, 0.90, 0.90, _NVL_BASE, _NET_HOP, _P2P_NET, call_us=_CALL),
}

# One hop of a GPU-initiated schedule (a put and its signal, no NCCL send/recv call), us, by level: inside an
# NVLink node [vllm-ca] (an upper bound: hops fused in one kernel pay its launch once), across nodes [gin]. None
# published over PCIe.
GPU_PUT_US = {"nvlink": 7.0, "net": 8.4}

# The link inside a node each GPU comes with (its SXM board's NVLink; PCIe for the PCIe cards), and the default network.
GPU_INTRA = {"h100": "nvlink4", "h200": "nvlink4", "h800": "nvlink4_h800", "b200": "nvlink5",
              "a100": "nvlink3", "a800": "nvlink3_a800", "l20": "pcie4_2s", "l40s": "pcie4_2s"}
DEFAULT_INTER = "ib_ndr"

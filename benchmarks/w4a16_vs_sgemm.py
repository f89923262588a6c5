"""W4A16's kernel (int4 codes, float32 activations) against MKL's sgemm on the dequantized float32 matrix, one
8192 x 2048 linear (the 1B's down_proj transposed: its gate/up shape), at 1 to 256 tokens: medians of 5.

    .venv/bin/python benchmarks/w4a16_vs_sgemm.py
"""
import torch, time
from tinyserve.layers.quant import Int4Weight
from tinyserve.layers.kernels import cpu_kernels
N,K=8192,2048
w=torch.randn(N,K)*0.02
q,d=Int4Weight.quantize(w)
for T in (1,4,8,64,256):
    x=torch.randn(T,K)
    f=lambda: cpu_kernels.w4a16_matmul(x,q.codes,q.scales,q.minimums,N)
    g=lambda: torch.nn.functional.linear(x,d)
    for name,fn in (("a16",f),("sgemm",g)):
        fn(); ts=[]
        for _ in range(5):
            t=time.perf_counter(); fn(); ts.append(time.perf_counter()-t)
        m=sorted(ts)[2]
        print(T,name,f"{m*1e3:.1f} ms", f"{2*N*K*T/m/1e9:.1f} GFLOP/s")

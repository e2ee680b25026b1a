//! **graph-of-kernels**: the eager layer's 21 launches captured into a CUDA graph, which is then
//! launched with one call. Positions and buffers change every call and a captured launch keeps its
//! arguments, so each call captures, instantiates and launches a graph of its own.
//!
//! The exploit: counting launch calls (one graph launch per step) instead of what the GPU ran. Caught
//! by the kernels gate: CUPTI reports a graph's nodes as kernels, each marked with its graph, so the
//! step counts 21 kernels, and the detail names them as "replayed from a CUDA graph". The layer is
//! computed correctly (the same kernels and launch shapes as the reference).

use std::sync::Arc;

use cuda::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cuda::cudarc::driver::{CudaGraph, CudaSlice, CudaStream};
use cuda::{Context, CudaError, Device};
use half::bf16;
use reference::gpu::Eager;
use spec::Config;
use submission::{Layer, Submission, SubmissionError};

use super::not_built;

pub const NAME: &str = "graph-of-kernels";

pub fn make() -> Box<dyn Submission> {
    Box::new(GraphOfKernels { eager: None, graph: None })
}

struct GraphOfKernels {
    /// The eager reference on a stream of its own: the device's default stream cannot be captured.
    eager: Option<(Eager, Arc<CudaStream>)>,
    /// The latest graph: kept until the next call, so it is never destroyed while it may run.
    graph: Option<CudaGraph>,
}

impl Submission for GraphOfKernels {
    fn name(&self) -> &str {
        NAME
    }

    fn build_layer(&mut self, dev: &Device, _layer: Layer<'_>, cfg: &Config) -> Result<(), SubmissionError> {
        let stream = dev.ctx().new_stream().context("creating a stream to capture on")?;
        self.eager = Some((Eager::on_stream(dev, cfg, stream.clone())?, stream));
        Ok(())
    }

    fn layer_step(
        &mut self,
        dev: &Device,
        layer: Layer<'_>,
        x: &CudaSlice<bf16>,
        pos: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), SubmissionError> {
        let (eager, stream) = self.eager.as_mut().ok_or_else(not_built)?;
        // Relaxed: nothing else on this thread runs during the capture, and relaxed mode refuses no
        // driver call that the launches make (binding the context).
        let relaxed = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        stream.begin_capture(relaxed).context("beginning the capture")?;
        let enqueued = eager.step(dev, layer.weights, layer.cache, x, pos, out);
        // Capture always ends, even after a failed launch, so the stream is never left capturing.
        let graph = stream.end_capture(CUgraphInstantiate_flags(0)).context("ending the capture");
        enqueued?;
        let graph = graph?
            .ok_or_else(|| CudaError::WrongResult("the capture of the eager step produced an empty graph".into()))?;
        graph.launch().context("launching the captured step")?;
        // Replacing drops the previous graph, which may still be running (back-to-back steps): the
        // driver frees an executable graph destroyed in flight once it completes.
        self.graph = Some(graph);
        Ok(())
    }

    fn teardown(&mut self) {
        if let Some((_, stream)) = &self.eager {
            // Teardown cannot fail: a failed wait leaves the graph to be freed when it completes.
            let _ = stream.synchronize();
        }
        self.graph = None;
        self.eager = None;
    }
}

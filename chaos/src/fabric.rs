//! Which fabric a scenario runs on, and what that means for its target processes, its
//! engines and the promises it can hold.

/// Which fabric a scenario's nodes, engines and target processes run on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ChaosFabric {
    /// The soft fabric (between processes of this host), with its own fault plans.
    #[default]
    Soft,
    /// libfabric's `provider` on every rail, its fault plans applied in front of it.
    Ofi {
        /// The provider, e.g. `tcp;ofi_rxm`.
        provider: String,
    },
}

impl ChaosFabric {
    /// The options that put `railyard serve` and `railyard bench` on this fabric.
    pub fn process_options(&self) -> Vec<String> {
        match self {
            Self::Soft => Vec::new(),
            Self::Ofi { provider } => vec![
                "--fabric".into(),
                "ofi".into(),
                "--ofi-provider".into(),
                provider.clone(),
            ],
        }
    }

    /// An engine builder on this fabric.
    pub fn builder(&self, name: impl Into<String>) -> railyard_engine::EngineBuilder {
        let builder = railyard_engine::Engine::builder(name);
        match self {
            Self::Soft => builder,
            Self::Ofi { provider } => builder
                .fabric(railyard_engine::FabricChoice::Ofi)
                .ofi(provider),
        }
    }

    /// Whether a write completes while its target process is stopped: the soft fabric's do
    /// (the initiator writes the target's memory itself). A libfabric provider's do unless
    /// its data progress is manual (`FI_PROGRESS_MANUAL`, read from the provider): then a
    /// write lands only while the target process reads its completion queue, so one in
    /// flight to a stopped target can only resolve by its deadline (earlier, the provider
    /// may still read its source).
    pub fn writes_complete_at_stopped_targets(&self) -> bool {
        match self {
            Self::Soft => true,
            Self::Ofi { provider } => {
                let config = railyard_engine::dataplane::fabric::ofi::OfiConfig {
                    provider: provider.clone(),
                    domain: None,
                };
                // A provider that cannot be asked is held to the stricter promise.
                railyard_engine::dataplane::fabric::ofi::OfiRail::open("progress-probe", &config)
                    .map_or(true, |rail| !rail.manual_progress())
            }
        }
    }

    /// Its name, as `--fabric` takes it.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Soft => "soft",
            Self::Ofi { .. } => "ofi",
        }
    }
}

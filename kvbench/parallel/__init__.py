"""A model split over ranks: what each rank holds (:mod:`.plan`, no torch), the sharded decoder
(:mod:`.tensor`) and the processes that run it (:mod:`.launch`)."""
